"""A fixed English text for calibration and perplexity when no file is given (written for
this project, so it can ship with it)."""

BUILTIN_TEXT = """\
The harbour town woke slowly in the grey light of early spring. Fishing boats rocked
against the stone quay, their ropes creaking, while gulls circled above the market
square and argued over scraps left from the day before. Anna opened the shutters of
the bakery at six, as her mother had done for thirty years, and the smell of warm
bread drifted down the narrow street toward the water.

Most people in the town knew one another by name. The schoolteacher walked past at
half past seven with a bundle of books under his arm; the postman followed a little
later, whistling the same tune every morning. When the ferry arrived from the mainland,
the whole street seemed to lean toward the harbour to see who had come and what they
had brought with them.

Science, at its best, is a patient way of asking questions. A researcher begins with an
observation that does not fit, proposes an explanation, and then tries as hard as
possible to prove that explanation wrong. Experiments are repeated, numbers are
checked, and results are shared so that others can test them. Over many years, the
explanations that survive this process become the theories we rely on to build bridges,
cure diseases and send machines to distant planets.

Computers follow instructions exactly, which is both their strength and their
weakness. A program that adds two numbers will do so billions of times without a
single mistake, yet it will never notice that the numbers themselves were wrong. Good
software therefore checks its inputs, reports clear errors, and keeps its promises
simple enough that a person can understand them. Tests describe what the program
should do, and every change is measured against them before it is shipped.

In the evening the wind turned and brought rain from the west. The boats came back one
by one, their lights swinging in the dark, and the fishermen carried their catch up
the wet steps to the hall where buyers were already waiting. Prices were called out,
hands were shaken, and by nine o'clock the square was empty again except for a cat
sleeping under the awning of the closed bakery.

History is not only a record of kings and battles. It is also the story of ordinary
people who planted fields, raised children, traded goods and wrote letters to friends
far away. Archives hold their receipts, diaries and maps, and historians read these
fragments carefully to understand how people lived, what they believed, and why they
made the choices they did. Each generation asks new questions of the same old papers.

The river that runs through the valley begins as a thin stream high in the mountains.
Snow melts in the spring sun, trickles between rocks, and gathers into pools where
small fish dart in the shadows. Further down, other streams join it, and by the time it
reaches the plain it is wide and slow, carrying mud and leaves and the reflections of
clouds. Farmers draw water from it for their crops, and children swim in it in summer.

Learning a language takes time and a great deal of listening. At first every sentence
sounds like a single long word, and the rules seem to have more exceptions than
examples. Then, slowly, patterns appear: a word heard in the market shows up again in
a song, a phrase from a book turns out to be useful at the train station. One day the
learner realises that they have been thinking in the new language without noticing.
"""
