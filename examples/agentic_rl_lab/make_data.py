"""Write the small offline data files that the agentic-rl-lab chapter scripts read.

    python examples/agentic_rl_lab/make_data.py --out /tmp/arl-data

writes

- ``search_r1/train.jsonl``: questions in the format 03-search-r1's ``data.py`` reads (``id``, ``question``,
  ``answers``, ``data_source``), for ``train.py --data``;
- ``search_r1/corpus.jsonl``: the documents ``search_backend.py`` searches (``title``, ``text``);
- ``search_r1/warmup.jsonl``: other questions over the same corpus, with the query a searcher would send and the
  answer, for ``warmup.py`` (none of them is a training question);
- ``opd/DeepMath-103K/data/train-00000-of-00010.parquet``: a ``question`` column in the file layout
  02-opd's ``general-opd/01-demo-sync.py`` reads (``--dataset-dir``): the script skips its download when the
  shard exists.

Every fact is written here (short encyclopedic sentences); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (title, text, question, answer, query). The first TRAIN_COUNT rows are the training questions, the rest the
# warm-up questions: the two sets share the corpus, never a question.
FACTS: list[tuple[str, str, str, str, str]] = [
    (
        "Hamlet",
        "Hamlet is a tragedy written by William Shakespeare around 1600. It is set in Denmark.",
        "Who wrote the play Hamlet?",
        "William Shakespeare",
        "Hamlet play author",
    ),
    (
        "Marie Curie",
        "Marie Curie was a physicist and chemist born in Warsaw, Poland, in 1867. She won two Nobel Prizes.",
        "In which city was Marie Curie born?",
        "Warsaw",
        "Marie Curie birthplace",
    ),
    (
        "Mount Kilimanjaro",
        "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa.",
        "In which country is Mount Kilimanjaro?",
        "Tanzania",
        "Mount Kilimanjaro country",
    ),
    (
        "Python (programming language)",
        "Python is a programming language created by Guido van Rossum and first released in 1991.",
        "Who created the Python programming language?",
        "Guido van Rossum",
        "Python programming language creator",
    ),
    (
        "Danube",
        "The Danube is a river in Europe. It flows into the Black Sea through Romania and Ukraine.",
        "Into which sea does the Danube flow?",
        "Black Sea",
        "Danube river mouth sea",
    ),
    (
        "The Starry Night",
        "The Starry Night is an oil painting by Vincent van Gogh, painted in June 1889.",
        "Who painted The Starry Night?",
        "Vincent van Gogh",
        "The Starry Night painter",
    ),
    (
        "Canberra",
        "Canberra is the capital city of Australia. It was selected as the capital in 1908.",
        "What is the capital of Australia?",
        "Canberra",
        "capital of Australia",
    ),
    (
        "Penicillin",
        "Penicillin was discovered in 1928 by Alexander Fleming, a Scottish physician.",
        "Who discovered penicillin?",
        "Alexander Fleming",
        "penicillin discovery",
    ),
    (
        "Lake Baikal",
        "Lake Baikal is a rift lake in Siberia, Russia. It is the deepest lake in the world.",
        "In which country is Lake Baikal?",
        "Russia",
        "Lake Baikal location",
    ),
    (
        "Don Quixote",
        "Don Quixote is a Spanish novel by Miguel de Cervantes, published in two parts in 1605 and 1615.",
        "Who wrote Don Quixote?",
        "Miguel de Cervantes",
        "Don Quixote author",
    ),
    (
        "Ottawa",
        "Ottawa is the capital city of Canada. It stands on the south bank of the Ottawa River.",
        "What is the capital of Canada?",
        "Ottawa",
        "capital of Canada",
    ),
    (
        "Albert Einstein",
        "Albert Einstein was a theoretical physicist born in Ulm, Germany, in 1879.",
        "In which city was Albert Einstein born?",
        "Ulm",
        "Albert Einstein birthplace",
    ),
    (
        "Telephone",
        "Alexander Graham Bell was awarded the first United States patent for the telephone in 1876.",
        "Who received the first patent for the telephone?",
        "Alexander Graham Bell",
        "telephone patent inventor",
    ),
    (
        "Amazon River",
        "The Amazon River flows through South America and empties into the Atlantic Ocean in Brazil.",
        "Into which ocean does the Amazon River flow?",
        "Atlantic Ocean",
        "Amazon River mouth ocean",
    ),
    (
        "Pride and Prejudice",
        "Pride and Prejudice is an 1813 novel by the English writer Jane Austen.",
        "Who wrote Pride and Prejudice?",
        "Jane Austen",
        "Pride and Prejudice author",
    ),
    (
        "Mona Lisa",
        "The Mona Lisa is a portrait painted by Leonardo da Vinci. It hangs in the Louvre in Paris.",
        "Who painted the Mona Lisa?",
        "Leonardo da Vinci",
        "Mona Lisa painter",
    ),
    (
        "Nairobi",
        "Nairobi is the capital and largest city of Kenya.",
        "What is the capital of Kenya?",
        "Nairobi",
        "capital of Kenya",
    ),
    (
        "Isaac Newton",
        "Isaac Newton was an English mathematician and physicist born in Woolsthorpe, England, in 1643.",
        "In which village was Isaac Newton born?",
        "Woolsthorpe",
        "Isaac Newton birthplace",
    ),
    (
        "Mount Fuji",
        "Mount Fuji is an active volcano on the island of Honshu. It is the highest mountain in Japan.",
        "In which country is Mount Fuji?",
        "Japan",
        "Mount Fuji country",
    ),
    (
        "Light bulb",
        "Thomas Edison developed a long-lasting carbon filament light bulb in 1879.",
        "Who developed the long-lasting carbon filament light bulb?",
        "Thomas Edison",
        "carbon filament light bulb inventor",
    ),
    (
        "War and Peace",
        "War and Peace is a novel by the Russian author Leo Tolstoy, first published in 1869.",
        "Who wrote War and Peace?",
        "Leo Tolstoy",
        "War and Peace author",
    ),
    (
        "Nile",
        "The Nile is a river in northeastern Africa. It flows north into the Mediterranean Sea in Egypt.",
        "Into which sea does the Nile flow?",
        "Mediterranean Sea",
        "Nile river mouth sea",
    ),
    (
        "Guernica (Picasso)",
        "Guernica is a 1937 oil painting by the Spanish artist Pablo Picasso.",
        "Who painted Guernica?",
        "Pablo Picasso",
        "Guernica painting artist",
    ),
    (
        "Brasilia",
        "Brasilia is the federal capital of Brazil. It was inaugurated in 1960.",
        "What is the capital of Brazil?",
        "Brasilia",
        "capital of Brazil",
    ),
    (
        "Charles Darwin",
        "Charles Darwin was an English naturalist born in Shrewsbury, England, in 1809.",
        "In which town was Charles Darwin born?",
        "Shrewsbury",
        "Charles Darwin birthplace",
    ),
    (
        "Mount Elbrus",
        "Mount Elbrus is a dormant volcano in the Caucasus Mountains in Russia.",
        "In which country is Mount Elbrus?",
        "Russia",
        "Mount Elbrus country",
    ),
    (
        "World Wide Web",
        "The World Wide Web was invented by Tim Berners-Lee at CERN in 1989.",
        "Who invented the World Wide Web?",
        "Tim Berners-Lee",
        "World Wide Web inventor",
    ),
    (
        "Moby-Dick",
        "Moby-Dick is an 1851 novel by the American writer Herman Melville.",
        "Who wrote Moby-Dick?",
        "Herman Melville",
        "Moby-Dick author",
    ),
    (
        "Wellington",
        "Wellington is the capital city of New Zealand, at the southern tip of the North Island.",
        "What is the capital of New Zealand?",
        "Wellington",
        "capital of New Zealand",
    ),
    (
        "Ada Lovelace",
        "Ada Lovelace was an English mathematician born in London in 1815, known for her notes on the "
        "Analytical Engine.",
        "In which city was Ada Lovelace born?",
        "London",
        "Ada Lovelace birthplace",
    ),
]
TRAIN_COUNT = 10

# Short arithmetic prompts for the OPD demo (its prompt pool reads only the "question" column).
MATH_QUESTIONS = [
    "What is 7 + 5?",
    "What is 9 times 3?",
    "What is 20 minus 8?",
    "What is half of 18?",
    "What is 6 squared?",
    "What is 100 divided by 4?",
    "What is 15 + 27?",
    "What is 3 times 11?",
]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_search_r1(out: Path) -> None:
    folder = out / "search_r1"
    write_jsonl(folder / "corpus.jsonl", [{"title": title, "text": text} for title, text, *_ in FACTS])
    train = [
        {
            "id": f"local-{index}",
            "question": question,
            "answers": [answer],
            "data_source": "nq" if index % 2 == 0 else "hotpotqa",
        }
        for index, (_, _, question, answer, _) in enumerate(FACTS[:TRAIN_COUNT])
    ]
    write_jsonl(folder / "train.jsonl", train)
    warmup = [
        {"question": question, "query": query, "answer": answer, "title": title, "text": text}
        for title, text, question, answer, query in FACTS[TRAIN_COUNT:]
    ]
    write_jsonl(folder / "warmup.jsonl", warmup)
    print(f"{folder}: {len(train)} training questions, {len(warmup)} warm-up questions, {len(FACTS)} documents")


def write_opd(out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    shard = out / "opd" / "DeepMath-103K" / "data" / "train-00000-of-00010.parquet"
    shard.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"question": MATH_QUESTIONS}), shard)
    print(f"{shard}: {len(MATH_QUESTIONS)} questions")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to write the data into")
    args = parser.parse_args()
    write_search_r1(args.out)
    write_opd(args.out)


if __name__ == "__main__":
    main()
