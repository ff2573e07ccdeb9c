"""Speculative decoding proposers and rejection sampler for Ember.

The rejection sampler (torch) is imported on first use, so that a process that only reads a
``SpeculativeConfig`` (the API server parsing ``--speculative-config``) never imports torch.
"""

from ember_spec_decode.config import SpeculativeConfig
from ember_spec_decode.ngram import NgramProposer
from ember_spec_decode.proposal import Proposal, TokenProposer

__version__ = "0.1.0"

__all__ = [
    "NgramProposer",
    "Proposal",
    "RejectionOutput",
    "SpeculativeConfig",
    "TokenProposer",
    "rejection_sample",
]

_TORCH_NAMES = {"RejectionOutput", "rejection_sample"}


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        from ember_spec_decode import rejection_sampler

        return getattr(rejection_sampler, name)
    raise AttributeError(f"module 'ember_spec_decode' has no attribute {name!r}")
