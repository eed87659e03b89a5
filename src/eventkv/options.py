"""Option vocabularies shared by the library and every CLI command (no heavy imports here, so the
CLI's ``--help`` stays fast)."""

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""What ``--dtype`` / ``models.load(dtype=...)`` accept; ``"auto"`` is resolved by ``models.resolve_dtype``."""

DTYPE_HELP = ("auto (default): bfloat16 where the hardware computes it natively (CUDA on Ampere or later; a CPU "
              "with AVX512-BF16 or AMX), else float32 | float32 | bfloat16 | float16. The choice and the reason "
              "are recorded in the manifest")
