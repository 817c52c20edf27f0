"""What the test modules share: device lists, fixtures, harnesses, case tables and test doubles, one concept
per module. A test module imports from here, never from another test module (tests/project/test_layers.py checks)."""
