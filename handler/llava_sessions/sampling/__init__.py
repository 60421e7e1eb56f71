"""Sampling: the parameters and their bounds (:mod:`.params`, no torch) and the sampler and
incremental detokenizer over logits (:mod:`.sampler`). Import the module you need: this file loads none."""
