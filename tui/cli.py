def main():
    print("batchtop")
