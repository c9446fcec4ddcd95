"""Scheduling: how many drafts each request sends to the verifier per round.

`prefix_scheduler` holds the math as pure functions (docs/method.md §5: Algorithm 1 with its
plain reference, the no-break full search, the async variant, the brute-force optimum);
`policies` wraps it and the baselines behind one interface, parsed from strings such as
"fixed:3" or "dspark". Run the tests with `python -m pytest tests/scheduling -q`.
"""

from dspark.scheduling.policies import (
    POLICY_FORMS,
    DSparkAsyncPolicy,
    DSparkPolicy,
    FixedPolicy,
    NonePolicy,
    Policy,
    ThresholdPolicy,
    parse_policy,
)
from dspark.scheduling.prefix_scheduler import (
    admit_top_k,
    brute_force_optimum,
    full_search_capacity,
    schedule,
    schedule_async,
    schedule_full_search,
    schedule_reference,
    survival_products,
    throughput_objective,
)

__all__ = [
    "POLICY_FORMS",
    "DSparkAsyncPolicy",
    "DSparkPolicy",
    "FixedPolicy",
    "NonePolicy",
    "Policy",
    "ThresholdPolicy",
    "admit_top_k",
    "brute_force_optimum",
    "full_search_capacity",
    "parse_policy",
    "schedule",
    "schedule_async",
    "schedule_full_search",
    "schedule_reference",
    "survival_products",
    "throughput_objective",
]
