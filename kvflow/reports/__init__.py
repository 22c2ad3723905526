"""What people look at after a replay: they read report dicts and need neither world.

``render`` turns a report into tables and an HTML/PNG page, ``compare`` puts
reports side by side, ``sweep`` runs a grid of replays (local process pool or
Dask) and plots it, ``cli`` registers ``kvflow report | compare | sweep``.
"""
