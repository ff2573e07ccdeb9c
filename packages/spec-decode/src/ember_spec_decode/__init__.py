"""Speculative decoding proposers and rejection sampler for Ember."""

from ember_spec_decode.config import SpeculativeConfig
from ember_spec_decode.ngram import NgramProposer
from ember_spec_decode.proposal import Proposal, TokenProposer
from ember_spec_decode.rejection_sampler import RejectionOutput, rejection_sample

__version__ = "0.1.0"

__all__ = [
    "NgramProposer",
    "Proposal",
    "RejectionOutput",
    "SpeculativeConfig",
    "TokenProposer",
    "rejection_sample",
]
