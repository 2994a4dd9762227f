"""Checkpoint errors (no heavy imports: the CLI catches these before torch is loaded)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class HFCheckpointError(ValueError):
    """An HF checkpoint folder is missing, incomplete or does not fit the model."""


class WeightMapError(KeyError):
    """A tensor has no counterpart on the other side of an HF ⇄ Megatron mapping."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])
