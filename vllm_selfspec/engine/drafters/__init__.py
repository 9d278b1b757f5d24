"""The drafters, one file per drafting strategy (``Policy.drafter``): plan.py, cascade.py,
adadecode.py (``deferred``) and feature.py. What a drafter is and what of the engine it uses:
``engine/drafting.py``; the registry, by name: ``engine.proposer.DRAFTERS``."""
