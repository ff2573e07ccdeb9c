"""The engine client side: the offline ``LLM``, ``AsyncLLM``, input and output processing, the
engine core process and its client, engine assembly from ``EngineArgs``, data-parallel routing.

Its modules are imported one by one (``ember_server.engine.llm``...): the API server reads
``engine_args`` and ``async_llm`` without the torch that ``llm`` and ``engine_factory`` bring.
"""
