"""What only a GPU runs of the model: passes at static shapes captured as CUDA graphs, and what a GPU's
start prepares for them. A CPU runs the same static passes eagerly where a test asks for them.

==================== ================================================================================
module               owns
==================== ================================================================================
``graph_table``      ``GraphTable``: one pass's graphs by bucket key (replay, eager fallback, counters),
                     and the capture loop every kind shares
``graphs``           ``DecodeGraphs``: the decode step at static shapes, per bucket of rows and length
``prefill_graphs``   ``PrefillGraphs``: a prefill chunk at static shapes, beside the decode graphs
``vision_graph``     ``VisionGraph``: llava-1.5's vision tower replayed
``tile_graphs``      ``TileGraphs``: LLaVA-NeXT's and OneVision's vision tower per tile count
``staging``          pinned host buffers and events for a step's copies to the device
``pixels``           llava-1.5's image preprocessing on the device
``projections``      each layer's q/k/v and gate/up fused into one GEMM each
``regions``          each layer's norms and MLP compiled by Inductor
``compile_cache``    a model folder's compile cache, loaded at start
==================== ================================================================================
"""
