"""Which dtype each job computes in: measured on the work it decides, decided by one rule, kept
per machine, recorded per run. Modules, each importing only those above it (and core/):
    rule.py       measured timings -> the dtype (pure: the margin, the confidence test, the tie default)
    probes.py     the work each job is timed on (models of the real sizes, random weights), timed
    policy.py     this machine's decision per work: `auto` resolved, measured once and kept
    decisions.py  what each dtype param of a params file resolves to (the dtypes stage, `eagle3 dtypes`)
    resolved.py   the decisions recorded in artifacts/dtypes/ for DVC, and params pinned to them
    precision.py  how training computes in a dtype (bf16: autocast over float32 master weights)
"""
