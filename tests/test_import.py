def test_import():
    import swarm
    assert swarm.__version__
