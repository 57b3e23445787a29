"""Engine integrations: block ids for token sequences, the paged-KV data path,
the vLLM connector and the transformers prefix cache.

- ``cascade.integrations.ids``: prefix-chained block ids (``KvNamespace``,
  ``prefix_block_ids``).
- ``cascade.integrations.kv``: engine KV pages to and from a store
  (``PagedKv``, ``save_paged``, ``load_paged``, ``cached_prefix_length``).
- ``cascade.integrations.vllm``: ``CascadeConnector`` for vLLM's
  ``--kv-transfer-config`` (needs vLLM).
- ``cascade.integrations.transformers``: a prefix cache for Hugging Face
  causal LMs (needs transformers).

Submodules are imported on use, so this package imports without torch,
vLLM or transformers.
"""
