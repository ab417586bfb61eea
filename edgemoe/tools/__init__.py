"""Tools beside the engine: `edgemoe bench`, the profiler, the cache simulator, random checkpoints."""
