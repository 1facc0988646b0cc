"""A draft-vocabulary sweep turned into an answer: the experiments as rows (experiments.py), what
each run costs (plan.py: `eagle3 plan`'s figures; costs.py: per row and on another target), the
paired bench's intervals (paired.py), the decision and why (decide.py), and the report's files
(render.py). cli/ parses the arguments and prints."""
