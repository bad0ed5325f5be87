"""swarm.proto"""
