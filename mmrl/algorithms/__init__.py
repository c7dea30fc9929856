"""Algorithm variants as registered plug-ins (:mod:`mmrl.algorithms.base` documents the stages and the contract).

Importing this package registers every built-in variant; ``mmrl variants`` lists them with their options and papers.
"""

from mmrl.algorithms.base import (REGISTRY, STAGES, AdvantageContext, Intermediate, RewardContext, Rewards,
                                  SelectContext, SurrogateContext, TransformContext, Variant, VariantError,
                                  build_variants, describe_variant, lookup, option, register)
from mmrl.algorithms import (  # noqa: F401 - one module per variant; importing registers it
    a_grae, adaptive_noise, blockwise, clip_delta, contrastive_baseline, cosine_credit, cspo, dapo, delightful_pg,
    dip_looking, disco, drpo, dvao, dvrp, e_grpo, etr, factorized, focal_advantage, g2rpo, g2rpo_shaping, ga_grpo,
    gigpo, grip, grpo_care, gvpo, length_control, lens, mc_grpo, mig, ngrpo, papo, par, perceval, prco, pure_credit,
    reg_grpo, rgra, rs_grpo, rvco, stare, step_gain, t_grpo, taco, trust_grpo, ttrv, turning_point, tw_grpo,
    variance_selection, vgpo, vig, vision_sr1)

__all__ = ["REGISTRY", "STAGES", "AdvantageContext", "Intermediate", "RewardContext", "Rewards", "SelectContext",
           "SurrogateContext", "TransformContext", "Variant", "VariantError", "build_variants", "describe_variant",
           "lookup", "option", "register"]
