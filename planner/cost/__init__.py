"""The analytical cost model: parameters, FLOPs, compute time, memory, communication, pipeline."""
