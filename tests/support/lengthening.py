"""A tool response of real shape for the lengthening tests: a car-rental search's JSON (records under
`data.search_results`), the chat request that carries it, and the records read back out of a perturbed request."""

from __future__ import annotations

import json
from typing import Any

from toolquake.perturbers.helpers.lengthening.records import find_main_array

QUESTION = "What is the cleanliness rating of vehicle 693265999? Answer with the number only."


def car(vehicle_id: str, name: str, price: float, clean: float, supplier: str) -> dict[str, Any]:
    return {"vehicle_id": vehicle_id,
            "vehicle_info": {"v_name": name, "free_cancellation": 1, "transmission": "Automatic",
                             "image_url": f"https://cdn.example.com/cars/{vehicle_id}.jpg"},
            "pricing_info": {"base_price": price, "currency": "USD", "deposit": 250},
            "rating_info": {"cleanliness": clean, "value_for_money": 8.1},
            "supplier": {"name": supplier, "address": "1 World Way, Los Angeles", "location_code": "LAX01"},
            "pickup_date": "2024-09-18T10:00:00", "features": ["gps", "bluetooth"]}


RESPONSE = {"status": True, "message": "Success", "timestamp": 1726600000,
            "data": {"count": 2, "provider": "booking.com",
                     "search_results": [car("693265221", "Toyota Corolla", 120.53, 8.7, "Hertz Downtown"),
                                        car("693265999", "Ford Focus", 99.1, 7.9, "Avis Airport")]}}


def tool_request(content: str | None = None, extra_tool: str | None = None) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You help people rent cars."},
        {"role": "user", "content": "Find me a rental car at LAX on September 18."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search_car_rentals", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": content if content is not None else json.dumps(RESPONSE)},
    ]
    if extra_tool is not None:
        messages[2]["tool_calls"].append({"id": "call_2", "type": "function",
                                          "function": {"name": "get_weather", "arguments": "{}"}})
        messages.append({"role": "tool", "tool_call_id": "call_2", "content": extra_tool})
    messages.append({"role": "user", "content": QUESTION})
    return {"model": "fake-model", "messages": messages,
            "tools": [{"type": "function", "function": {"name": "search_car_rentals", "description": "Search cars.",
                                                         "parameters": {"type": "object", "properties": {}}}}]}


def records_of(body: dict[str, Any], index: int = 3) -> list[Any]:
    value = json.loads(body["messages"][index]["content"])
    found = find_main_array(value)
    assert found is not None
    return found[1]
