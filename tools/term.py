"""Stream output as a terminal shows it, for README.md and the docs site.
fastprogress draws its bars with carriage returns: a captured stream holds every frame (and execnb splits them into
lines), where a terminal shows only what is left on each line, i.e. fastai's results table."""

def terminal_text(s:str)->str:
    "What a terminal shows after printing `s`: `\\r` goes back to the line's start, later text overwrites earlier"
    out = []
    for line in s.split('\n'):
        buf = []
        for seg in line.split('\r'): buf[:len(seg)] = seg  # each segment starts at column 0, overwrites what it covers
        text = ''.join(buf).rstrip()
        if text or '\r' not in line: out.append(text)  # a line a bar drew and then blanked is no output
    return '\n'.join(out)
