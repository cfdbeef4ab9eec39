"""The entry points, all Hydra apps on one harness: generate, bench, agree, micro, gpu_check, report."""
