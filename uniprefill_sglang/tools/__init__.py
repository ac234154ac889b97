"""Tooling around the plugin, not needed to serve with it: the demo, the long-context task
generator, the small-model converter, the CPU-engine setup and the prepacking baseline."""
