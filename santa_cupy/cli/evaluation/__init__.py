"""``santa-cupy eval``: accuracy of SANTA decode attention against exact dense attention.

Three evaluations, each a function of sampler x budget x S (samples) x seed:

- ``eval kernel``: real attention inputs captured from the model on a long text (q and the KV
  cache of every layer at one decode step); relative L2 error of the attention output against
  float64 exact attention on the same inputs.
- ``eval model``: teacher forcing on a long text: prefill a prefix with dense attention, then decode
  the rest token by token (feeding the true tokens) with the attention under test. Per-step
  KL(dense || santa) of next-token distributions, top-1 agreement, perplexity, and the greedy
  exact-match length (first divergence from dense greedy decoding) from the same prefix.
- ``eval retrieval``: a passcode planted at a chosen depth of a filler haystack of L tokens, asked
  for at the end; success = the greedy answer contains the code.

SANTA affects decode steps only (prefill is dense), so every scored prediction comes from a decode
step: the last prompt token is always fed through ``model.decode``.

Capturing attention inputs: ``AttentionRecorder`` is an attention hook (``LlamaModel.decode(...,
attention_hook=rec)``, llama_min.model.AttentionHook) that records ``(q, k_cache, v_cache,
lengths)`` per layer and then calls the configured attention. It works for every path (NumPy
dense, NumPy SANTA reference, CuPy DecodePlan).

Modules, one job each: metrics (pure NumPy, float64), settings (the attention under test), texts
(long text, passcode prompts), decoding (caches, recorder, steppers), runs (the evaluations and
the Session), config (options and their checks), report (tables, plot, JSON, merge), commands
(the ``eval`` group) and ruler (``eval ruler``).
"""


from santa_cupy.cli.evaluation.commands import eval_command
from santa_cupy.cli.evaluation.ruler import eval_ruler

eval_command.add_command(eval_ruler, "ruler")
