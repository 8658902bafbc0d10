import unittest

from dedupe import dedupe


class TestDedupe(unittest.TestCase):
    def test_unique(self):
        self.assertEqual(sorted(dedupe([1, 1, 2])), [1, 2])

    def test_order(self):
        self.assertEqual(dedupe([3, 1, 3, 2, 1]), [3, 1, 2])


if __name__ == "__main__":
    unittest.main()
