"""The example agent's tools: five deterministic functions over small fixed tables (no network, no clock).

`Toolbox` makes them for one run and notes every call it runs (name and arguments), so a task can check the
calls the agent made. The functions carry type hints and docstrings: the frameworks build the tool schemas the
model sees from them (the Agents SDK's `function_tool`, LangChain's `tool`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

# closed sets of values are enums in the tool's schema: a grammar-constrained backend (the embedded one) can
# then only produce one of them
Currency = Literal["USD", "EUR", "GBP", "JPY", "CHF"]
Day = Literal["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
Unit = Literal["km", "mi", "kg", "lb", "C", "F"]

#: city → (degrees Celsius, sky)
WEATHER = {"paris": (18, "sunny"), "tokyo": (24, "cloudy"), "berlin": (9, "rain"), "oslo": (4, "snow"),
           "madrid": (27, "clear")}
#: one unit of the currency in EUR
RATES = {"EUR": 1.0, "USD": 0.92, "GBP": 1.17, "JPY": 0.0062, "CHF": 1.04}
#: day of this week → events
EVENTS = {"monday": ["09:00 team planning", "18:00 yoga class"], "tuesday": ["10:00 dentist appointment"],
          "friday": ["12:30 lunch with Maria at Casa Lupo", "15:30 call with the bank"]}
#: (from, to) → factor, or a function for the temperatures
UNITS: dict[tuple[str, str], Any] = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("kg", "lb"): 2.204623,
                                     ("lb", "kg"): 0.453592, ("c", "f"): lambda x: x * 9 / 5 + 32,
                                     ("f", "c"): lambda x: (x - 32) * 5 / 9}
NOTES = ["Garden: plant the tomatoes after the last frost, in the south bed.",
         "Project Atlas: the deadline is Friday, the demo goes to the client on Monday.",
         "Books to read: The Left Hand of Darkness, Piranesi.",
         "Car: the next service is due at 90,000 km."]


def _number(value: Any) -> float | None:
    try:
        return float(str(value).replace(",", "").strip())
    except ValueError:
        return None


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


class Toolbox:
    """The tools of one agent run; `calls` lists what ran, in order, as (name, arguments)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def functions(self) -> list[Callable[..., str]]:
        box = self

        def get_weather(city: str) -> str:
            """Get the current weather in a city: temperature in degrees Celsius and the sky."""
            box.calls.append(("get_weather", {"city": city}))
            found = WEATHER.get(str(city).split(",")[0].strip().lower())
            if found is None:
                return f"No weather data for {city}."
            return f"{found[0]} degrees Celsius and {found[1]} in {str(city).strip().title()}."

        def convert_currency(amount: float, from_currency: Currency, to_currency: Currency) -> str:
            """Convert an amount of money from one currency to another."""
            box.calls.append(("convert_currency", {"amount": amount, "from_currency": from_currency,
                                                   "to_currency": to_currency}))
            a, src, dst = _number(amount), str(from_currency).strip().upper(), str(to_currency).strip().upper()
            if a is None or src not in RATES or dst not in RATES:
                return f"Cannot convert {amount} {from_currency} to {to_currency}."
            return f"{_fmt(a)} {src} = {a * RATES[src] / RATES[dst]:.2f} {dst}"

        def list_events(day: Day) -> str:
            """List the events in the user's calendar on a day of this week."""
            box.calls.append(("list_events", {"day": day}))
            events = EVENTS.get(str(day).strip().lower())
            return f"Events on {day}: " + ("; ".join(events) if events else "none") + "."

        def convert_units(value: float, from_unit: Unit, to_unit: Unit) -> str:
            """Convert a distance, weight or temperature from one unit to another."""
            box.calls.append(("convert_units", {"value": value, "from_unit": from_unit, "to_unit": to_unit}))
            x = _number(value)
            rule = UNITS.get((str(from_unit).strip().lower(), str(to_unit).strip().lower()))
            if x is None or rule is None:
                return f"Cannot convert {value} {from_unit} to {to_unit}."
            return f"{_fmt(x)} {from_unit} = {_fmt(rule(x) if callable(rule) else x * rule)} {to_unit}"

        def search_notes(query: str) -> str:
            """Search the user's notes for a word or phrase; returns the notes that mention it."""
            box.calls.append(("search_notes", {"query": query}))
            words = [w for w in str(query).lower().split() if len(w) > 2]
            found = [n for n in NOTES if any(w in n.lower() for w in words)]
            return " | ".join(found) if found else f"No note mentions {query}."

        return [get_weather, convert_currency, list_events, convert_units, search_notes]
