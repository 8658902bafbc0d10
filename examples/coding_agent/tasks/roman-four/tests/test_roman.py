import unittest

from roman import to_roman


class TestRoman(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(to_roman(3), "III")
        self.assertEqual(to_roman(1666), "MDCLXVI")

    def test_four(self):
        self.assertEqual(to_roman(4), "IV")

    def test_nineteen_ninety_four(self):
        self.assertEqual(to_roman(1994), "MCMXCIV")


if __name__ == "__main__":
    unittest.main()
