"""swarm.averaging"""
