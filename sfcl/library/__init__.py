"""The anchor library on disk and in memory: its file format (``store``), version roots above the
format (``versions``; ``versions.load_library`` is how callers open a library) and the search index
the snapshotter queries (``index``). Nothing here touches the model; libraries are built and
curated by ``sfcl.anchors``."""
