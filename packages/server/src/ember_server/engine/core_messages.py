"""Frames between the front end and the engine core process (msgspec msgpack; never pickle).

Front end -> engine core (ROUTER -> DEALER): ``[kind, payload]`` with ``kind`` one of ``ADD``
(an ``EngineCoreRequest``), ``ABORT`` (a list of request ids), ``WAKE`` (nothing: a request went
to a lock-step peer, ``lockstep``) or ``SHUTDOWN``. Engine core ->
front end: ``[READY, EngineCoreReady]`` or ``[FAILED, EngineCoreFailed]`` once on the input socket at start-up,
then ``EngineCoreOutputs`` on the output socket (PUSH -> PULL).
"""

from __future__ import annotations

import msgspec

ADD = b"ADD"
ABORT = b"ABORT"
SHUTDOWN = b"SHUTDOWN"
WAKE = b"WAKE"
READY = b"READY"
FAILED = b"FAILED"


class EngineCoreReady(msgspec.Struct, array_like=True):
    """The engine core's start-up handshake: what it built."""

    pid: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_kv_tokens: int  # the longest prompt the scheduler can ever hold in the KV cache
    prefix_caching_hash_algo: str  # the block hashes of its KV events (with ``block_size``)


class EngineCoreFailed(msgspec.Struct, array_like=True):
    """The engine core could not start: why, and whether the settings were at fault."""

    message: str
    bad_settings: bool  # a ValueError: something the user set (or left) cannot work
    traceback: str
