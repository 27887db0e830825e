"""Pooled mode's checkpoint policy: which states are kept, how kept entries
rank against each other and against attention KV, where prefill chunks end.
Retention, the scheduler, the pools and the engine glue ask it; none of them
decides.

``eviction``  the order pooled mode evicts in, declared as data: free-queue
              segments, entry kinds and where a freed one is filed, what a
              state entry is worth per byte against attention KV, admission's
              attempts
``positions`` where a request keeps a state: prefill checkpoints and their
              anchors, the prompt's own checkpoint, turn ends, the kind each
              is filed as once freed and the tokens it saves
``steps``     what one scheduler step computes and admits: chunk cuts at
              checkpoints, prefill pacing, room for the decodes behind a
              prompt, admission's growth reserve

The modules import only downward (``eviction`` < ``positions`` < ``steps``).
"""
