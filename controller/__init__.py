"""evocache.controller"""
