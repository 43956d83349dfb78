"""The measurements of scripts/gpu_check.sh (docs/gpu.md), one concept per module.

shapes:        the model shapes measured (8B, 1B, the demo target's), random weights built on the spot
timing:        wall-clock milliseconds of a step, synchronised with the device
verify_curve:  T(n) / T(1) of specd's runner, verify forwards of n new tokens per session, at batch B
decode_compare: specd's runner decode step against a plain transformers `generate` step
profile_fit:   the emulator's CostModel fitted to the curve, written as a sim profile
__main__:      the command line that scripts/gpu_check.sh calls
"""
