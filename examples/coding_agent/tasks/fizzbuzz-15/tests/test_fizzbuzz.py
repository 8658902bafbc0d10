import unittest

from fizzbuzz import fizzbuzz


class TestFizzbuzz(unittest.TestCase):
    def test_fizz(self):
        self.assertEqual(fizzbuzz(9), "Fizz")

    def test_buzz(self):
        self.assertEqual(fizzbuzz(10), "Buzz")

    def test_num(self):
        self.assertEqual(fizzbuzz(7), "7")

    def test_fizzbuzz(self):
        self.assertEqual(fizzbuzz(15), "FizzBuzz")
        self.assertEqual(fizzbuzz(45), "FizzBuzz")


if __name__ == "__main__":
    unittest.main()
