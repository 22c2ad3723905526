"""A cluster of engine instances: routers, a shared KV pool, and the wiring the driver uses.

``router`` holds the routing policies and what they see of instances;
``instances`` puts a router in front of several engines; ``pool`` is the KV
pool every instance can share instead of its own storage (one directory, the
instances' views of it, its aggregate bandwidth). The replay driver
(``kvflow.replay``) builds the engines, one per instance, in one world's loop.
"""
