"""vLLM test support: the stand-in platform plugin and the compile-then-generate entry point."""
