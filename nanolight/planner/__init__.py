"""The layout planner: predicted memory and step time per rank for every valid layout."""
