"""Study (c): next-word prediction with TFF's LSTM at epsilon 8, reduced scale (docs/STUDIES.md).

    python simulations/study_c_next_word.py [--set seeds=[0]]
"""

from fedprivacy.cli import run_study_script

if __name__ == "__main__":
    run_study_script(__file__, "study_c_next_word.yaml")
