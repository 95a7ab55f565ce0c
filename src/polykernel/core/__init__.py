"""The dispatcher's core: the op registry, the :class:`~polykernel.core.op.Op` object and its hot
path, the resolution order (selection), explain records and the runtime-fault policy.

Layers, bottom up (``[tool.importlinter]`` in pyproject.toml holds them): ``spec``/``errors`` →
``core.registry`` and its peers → ``tuning`` → ``core.selection`` → ``core.hot_path`` → ``core.op`` →
``distributed`` → ``compile`` → ``ops``/``backends`` → ``nn``/``integrations``/``testing`` →
``tools``. A lower layer hears from a higher one through a hook it exposes (``core.op.hooks``,
``core.registry``'s listeners), never by importing it, and annotates with the protocols of
``core.protocols`` (``OpLike``, ``DecisionLike``), never with a higher layer's class.
"""
