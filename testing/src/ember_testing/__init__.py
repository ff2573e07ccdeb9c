"""Private test helpers of the Ember monorepo (never published)."""

from ember_testing.models import ARCHITECTURES, model_config, tiny_model_path, tokenizer_path

__all__ = ["ARCHITECTURES", "model_config", "tiny_model_path", "tokenizer_path"]
