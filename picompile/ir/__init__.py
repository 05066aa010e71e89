"""The IR the passes transform: picompile's torch custom ops (``ops``), their arguments by name (``schema``),
graph helpers (``graph``) and the patterns several passes look for (``patterns``)."""
