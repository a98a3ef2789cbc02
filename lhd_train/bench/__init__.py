"""The benchmark stage: the trial loop (`trial`), the engine that runs trials concurrently (`engine`),
the task packs (`taskpack`), prompts, memory and the supervisor."""
