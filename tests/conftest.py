from vtoken.fuzz.profiles import load_profile

load_profile()
