"""Model loading, models, input batch, sampler and model runner of Ember."""

__version__ = "0.1.0"
