"""Simulated-fleet trials and ``kvroute demo``: start simulated pods, a router in front of them and a replay.

Kept out of ``router/`` so the router never imports ``simulator/`` or ``replay/``.
"""
