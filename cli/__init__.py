"""evocache.cli"""
