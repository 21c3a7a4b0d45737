"""The head's multi-rank cases, one module per family; tests/head_ranks.py runs them all in one
group of ranks, and the single-process tests call some of them on one rank."""
