"""The engine: requests in, streamed tokens out, as one continuously batched model.

``async_engine`` owns the step loop; ``scheduler`` decides what each step computes; ``model_runner``
is the only caller of the model; ``paged_kv`` and ``paged_attention`` put the pool's device tier
under it; ``sampling`` and ``detokenizer`` turn logits into text. Never decides what may be cached
(the cache manager does) and never speaks HTTP or Kafka.
"""
