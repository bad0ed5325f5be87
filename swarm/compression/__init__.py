"""swarm.compression"""
