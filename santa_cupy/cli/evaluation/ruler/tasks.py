"""RULER's 13 standard tasks: their generator families, tokens to generate and metrics, and the
run's defaults (lengths, settings, parity floor, data seed, generator time limit).
"""

from __future__ import annotations




PACKAGE = "nvidia-long-context-eval"
INSTALL_HINT = "pip install 'santa-cupy[ruler]'"

STANDARD_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                  "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
                  "vt", "cwe", "fwe", "qa_1", "qa_2")
# task -> RULER's generator ("task" of synthetic.yaml); tokens to generate and metric per generator
FAMILY = {t: "niah" for t in STANDARD_TASKS if t.startswith("niah")}
FAMILY.update(vt="variable_tracking", cwe="common_words_extraction", fwe="freq_words_extraction",
              qa_1="qa", qa_2="qa")
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}
METRIC = {"niah": "string_match_all", "variable_tracking": "string_match_all",
          "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
          "qa": "string_match_part"}
DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_SETTINGS = ("dense", "systematic/global/S=256", "systematic/fixed/S=256",
                    "systematic/fixed/S=2048", "systematic/global/S=128", "systematic/one_pass/S=256")
PARITY_FLOOR = 20.0          # tasks where dense scores below this are left out of parity claims
RESOLVE_POINTS = 2.0         # "resolve a 2-point difference": 2 points = 2 standard errors
DATA_SEED = 42               # prepare.py's random seed (chunk 0)
GENERATOR_TIMEOUT_S = 300    # + 5 s per sample: a generator that loops forever (see generate_task)

