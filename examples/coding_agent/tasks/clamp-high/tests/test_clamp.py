import unittest

from clamp import clamp


class TestClamp(unittest.TestCase):
    def test_low(self):
        self.assertEqual(clamp(-3, 0, 10), 0)

    def test_mid(self):
        self.assertEqual(clamp(5, 0, 10), 5)

    def test_high(self):
        self.assertEqual(clamp(12, 0, 10), 10)
        self.assertEqual(clamp(11, 0, 10), 10)


if __name__ == "__main__":
    unittest.main()
