"""A cluster of engine instances: routers, and the wiring the replay driver uses.

``router`` holds the routing policies and what they see of instances;
``instances`` puts a router in front of several engines. The replay driver
(``kvflow.replay``) builds the engines, one per instance, in one world's loop.
"""
