"""``kvroute simulate`` and ``kvroute plan``: the router's live decision code against pod models, in simulated time."""
