"""Driver for the "CPU, 8k context" runs of docs/ACCURACY.md (issue 5, the 8k end of its 4k-8k range).

Same machinery as cpu4k_run.py (one dense prefill per text or prompt, shared by every setting), at
~8000 tokens. On 2 CPU cores an 8k dense prefill takes ~2.7 min and a SANTA decode step ~1 s, so
the grids are sized for ~30 min in all. Run from the repo root:

    PYTHONPATH=. python docs/results/cpu8k_run.py model     docs/results/accuracy_cpu8k_model
    PYTHONPATH=. python docs/results/cpu8k_run.py retrieval docs/results/accuracy_cpu8k_retrieval
"""
import sys

from cpu4k_run import run  # docs/results/ is on sys.path when this file is run as a script

# the last 32 tokens of an 8000-token text (a 7967-token dense prefix); small S and the default S
MODEL = dict(context=8000, steps=32, greedy_tokens=0, seeds="0,1",
             settings=[(sm, "global", s) for sm in ("iid", "systematic") for s in (16, 64, 256)])
# 4 prompts of 8000 tokens (2 depths x 2 needles); each costs one 8k prefill
RETRIEVAL = dict(lengths="8000", depths="0.25,0.75", needles=2, answer_tokens=16, seeds="0,1",
                 settings=[("systematic", "global", 256), ("iid", "global", 256),
                           ("systematic", "global", 64)])

if __name__ == "__main__":
    run({"model": MODEL, "retrieval": RETRIEVAL}[sys.argv[1]], sys.argv[1], sys.argv[2])
